"""The quiet console: rank 0's lines reach the person through console.log, whole lines only."""

from __future__ import annotations

import io

from runner.console import CONSOLE_ENV, Follower, say


def test_say_prints_and_copies_to_the_console_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "console.log"
    monkeypatch.setenv(CONSOLE_ENV, str(path))
    say("step 1/2 | loss 8.3")
    assert capsys.readouterr().out == "step 1/2 | loss 8.3\n"
    assert path.read_text() == "step 1/2 | loss 8.3\n"
    monkeypatch.setenv(CONSOLE_ENV, str(tmp_path / "missing" / "dir" / "console.log"))
    say("still printed")  # an unwritable copy never breaks training
    assert capsys.readouterr().out == "still printed\n"


def test_follower_shows_whole_lines_only_and_drains_at_the_end(tmp_path):
    path = tmp_path / "console.log"
    path.write_text("")
    out = io.StringIO()
    with Follower(path, out=out, interval=0.01):
        with open(path, "a") as handle:
            handle.write("first line\nsecond, half")
            handle.flush()
            import time

            time.sleep(0.1)
            assert out.getvalue() == "first line\n"  # the half line waits
            handle.write(" done\n")
    assert out.getvalue() == "first line\nsecond, half done\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_tokenizer_progress_bar_shows_on_a_terminal_only(tmp_path, monkeypatch):
    """Console-line assertions (one error line, exit 2) never see a progress bar: the bar is
    switched off unless stderr is a terminal, by construction, not by a 5-second delay that a
    loaded machine outlasts (test_damaged_published_runs_are_one_clear_line and the bank-FAQ
    dry run failed so). Shown with no delay at all."""
    from gptplan import progress, tokenizer

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    docs = [f"the {i}th line of a small corpus, words and more words" for i in range(200)]
    for stream, shown in ((io.StringIO(), False), (_Terminal(), True)):
        monkeypatch.setattr("sys.stderr", stream)
        out = tmp_path / f"tok-{shown}"
        tokenizer.train_tokenizer(
            docs, vocab_size=300, out_dir=out, scheme="bpe", log=lambda *_: None
        )
        assert (out / "tokenizer.json").is_file()
        assert ("tokenizer training sample" in stream.getvalue()) is shown, stream.getvalue()


def test_unwatched_preparation_progress_is_whole_log_lines_never_stderr(monkeypatch):
    """The data preparation's progress off a terminal: a log line now and then (a run's
    console.log), nothing on stderr; on a terminal a live bar on stderr, nothing logged."""
    from gptplan import progress

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    for stream, tty in ((io.StringIO(), False), (_Terminal(), True)):
        monkeypatch.setattr("sys.stderr", stream)
        lines: list[str] = []
        with progress.bar(total=4e6, unit="B", desc="reading", log=lines.append, every_s=0) as bar:
            bar.set_postfix_str("12 docs")
            bar.update(2e6)
            bar.update(2e6)
        assert bool(stream.getvalue()) is tty and bool(lines) is not tty
        if not tty:
            assert lines[-1].startswith("reading: 100% of 4,000,000 B (") and "12 docs" in lines[-1]
        silent = progress.bar(total=1, unit="B", desc="x", log=lines.append, enabled=False)
        silent.update(1)
        assert len(lines) == (0 if tty else 2)  # enabled=False: silent everywhere

"""Proof that parallel layouts run correctly on the rehearsal device.

`python -m runner.device.selftest reference --out DIR` trains tiny PaddleNLP GPT and Llama models
in ONE plain-CPU process (the reference) and saves their initial weights; then, launched on the
device with `paddle.distributed.launch --devices 0,1[,2,3]`,
`python -m runner.device.selftest run --layouts tp2,tp2_sp --out DIR` trains the same models from
the same weights on the same batches in each layout, and rank 0 writes the per-step losses, the
step times and every tensor found off the device (parameters, gradients, optimizer states) to
DIR/<layout>.json. Layouts that share a process-group setup share one launch.

`--precisions bf16_o2,fp16_o1` (of bf16_o1, bf16_o2, fp16_o1, fp16_o2; fp16 with a dynamic loss
scaler) trains each layout in each of these AMP precisions (`paddle.amp.decorate` for O2, as
runner.train does) and writes DIR/<layouts>.<precisions>.json, keys <layout>/<family>/<precision>;
`--families gpt` trains one family only.

Layouts: tp2, tp2_sp (tensor parallel, + sequence parallel), pp2 (pipeline, train_batch, 1F1B),
stage1 (fleet sharding), stage2, stage3 (group_sharded_parallel), dp2, and with 4 processes pp4,
vpp4 (pp 4 with 2 virtual stages each: Paddle's interleaved schedule needs pp > 2), dp2_tp2,
pp2_tp2, stage1_tp2_sp, dp2_pp2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gptplan import families as _families
from runner.device import off_device

if TYPE_CHECKING:
    import numpy as np
    import paddle
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup

FAMILIES = (_families.gpt.SPEC.name, _families.llama.SPEC.name)
STEPS = 3
BATCH = 4  # global batch (samples)
SEQ = 32
VOCAB = 256
LR = 1e-3
# AMP: precision name -> (Paddle dtype, level); fp32 is no AMP
AMP: dict[str, tuple[Literal["bfloat16", "float16"], Literal["O1", "O2"]]] = {
    "bf16_o1": ("bfloat16", "O1"),
    "bf16_o2": ("bfloat16", "O2"),
    "fp16_o1": ("float16", "O1"),
    "fp16_o2": ("float16", "O2"),
}
PRECISIONS = ("fp32", *AMP)
LOSS_SCALE = 1024.0  # fp16's initial (dynamic) loss scale
# which launch each layout needs: (fleet hybrid degrees or None for init_parallel_env, nprocs)
GROUPS = {
    "tp2": ("mp2", 2),
    "tp2_sp": ("mp2", 2),
    "pp2": ("pp2", 2),
    "pp4": ("pp4", 4),
    "vpp4": ("pp4", 4),  # Paddle's interleaved schedule needs pp > 2
    "stage1": ("sharding2", 2),
    # group_sharded_parallel on the global group: shares the launch of fleet's stage 1
    "stage2": ("sharding2", 2),
    "stage3": ("sharding2", 2),
    "dp2": ("dp2", 2),
    "dp2_tp2": ("dp2mp2", 4),
    "stage1_tp2_sp": ("sharding2mp2", 4),
    "dp2_pp2": ("dp2pp2", 4),
    "pp2_tp2": ("pp2mp2", 4),
}


def _load(path: str) -> Any:  # a PaddleNLP class (untyped)
    from gptplan import paddlenlp_light

    module, _, name = path.partition(":")
    return getattr(paddlenlp_light.import_module(module), name)


def _config(
    family: str, *, tp: int = 1, tp_rank: int = 0, sp: bool = False, pp: int = 1, vpp: int = 1
) -> Any:  # a PaddleNLP config (untyped)
    """The family's PaddleNLP config (gptplan.families names its classes). One set of
    arguments for every family: a config keeps the ones its model does not read."""
    from gptplan import families

    return _load(families.get(family).config_class)(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=8,  # pp 4 x 2 virtual stages
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        tensor_parallel_degree=tp,
        tensor_parallel_rank=tp_rank,
        sequence_parallel=sp,
        pipeline_parallel_degree=pp,
        virtual_pp_degree=vpp,
        seq_length=SEQ,
        hidden_dropout_prob=0.0,  # deterministic: no dropout anywhere
        attention_probs_dropout_prob=0.0,
        rms_norm_eps=1e-6,
        use_flash_attention=False,
    )


def _classes(family: str) -> tuple[Any, Any]:  # PaddleNLP model classes (untyped)
    from gptplan import families

    spec = families.get(family)
    return _load(spec.causal_lm_class), _load(spec.pipeline_class)


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    import numpy as np

    rng = np.random.default_rng(1234)
    # ids from 3 on: no pad/bos/eos label, so every rank averages over as many tokens
    ids = rng.integers(3, VOCAB, size=(STEPS, BATCH, SEQ + 1)).astype("int64")
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _loss(out: paddle.Tensor | tuple[paddle.Tensor, ...] | list[paddle.Tensor]) -> paddle.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def reference(out_dir: Path, families: tuple[str, ...] = FAMILIES) -> None:
    """One process, plain CPU: initial weights (save_pretrained) and the per-step losses."""
    import paddle

    paddle.set_device("cpu")
    result = {}
    for family in families:
        paddle.seed(2024)
        model = _classes(family)[0](_config(family))
        init = out_dir / f"init_{family}"
        model.save_pretrained(str(init))
        # a tied output projection (GPT's lm_head IS the word embedding) is saved under its
        # own key too, which PaddleNLP 2.8.1 would load unsplit under tensor parallelism (it
        # splits only the embedding's key): keep the embedding's only
        state = model.state_dict()
        head = state.get("lm_head.weight")
        if head is not None and any(
            k != "lm_head.weight" and v.data_ptr() == head.data_ptr() for k, v in state.items()
        ):
            saved = paddle.load(str(init / "model_state.pdparams"))
            saved.pop("lm_head.weight", None)
            paddle.save(saved, str(init / "model_state.pdparams"))
        opt = paddle.optimizer.AdamW(learning_rate=LR, parameters=model.parameters())
        losses, times = [], []
        for x, y in _batches():
            t0 = time.perf_counter()
            loss = _loss(model(paddle.to_tensor(x), labels=paddle.to_tensor(y)))
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss.numpy().reshape(-1)[0]))
            times.append(time.perf_counter() - t0)
        result[family] = {"losses": losses, "step_s": times}
    (out_dir / "reference.json").write_text(json.dumps(result, indent=1), encoding="utf-8")


def _hybrid(group: str) -> HybridCommunicateGroup | None:
    import paddle.distributed as dist
    from paddle.distributed import fleet

    degrees = {
        "mp2": dict(mp_degree=2),
        "pp2": dict(pp_degree=2),
        "pp4": dict(pp_degree=4),
        "sharding2": dict(sharding_degree=2),
        "dp2": dict(dp_degree=2),
        "dp2mp2": dict(dp_degree=2, mp_degree=2),
        "pp2mp2": dict(pp_degree=2, mp_degree=2),
        "sharding2mp2": dict(sharding_degree=2, mp_degree=2),
        "dp2pp2": dict(dp_degree=2, pp_degree=2),
    }
    from runner.parallel import wait_for_the_store

    wait_for_the_store()  # else Paddle's first try may be refused and it waits 3 s
    if group == "plain":
        dist.init_parallel_env()
        return None
    d = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    d.update(degrees[group])
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = d  # type: ignore[assignment]
    if d["pp_degree"] > 1:
        strategy.pipeline_configs = {
            # 4 micro-batches of 1: the interleaved schedule needs at least 2 x pp of them
            "accumulate_steps": BATCH // d["dp_degree"],
            "micro_batch_size": 1,
        }
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group()


def run_layout(
    layout: str,
    family: str,
    init_dir: Path,
    hcg: HybridCommunicateGroup | None,
    device_type: str,
    precision: str = "fp32",
) -> dict:
    import contextlib

    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    world = dist.get_world_size()
    rank = dist.get_rank()
    tp = hcg.get_model_parallel_world_size() if hcg else 1
    tp_rank = hcg.get_model_parallel_rank() if hcg else 0
    pp = hcg.get_pipe_parallel_world_size() if hcg else 1
    vpp = 2 if layout.startswith("vpp") else 1
    sp = layout.endswith("_sp")
    config = _config(family, tp=tp, tp_rank=tp_rank, sp=sp, pp=pp, vpp=vpp)
    cls = _classes(family)[1 if pp > 1 else 0]
    model = cls.from_pretrained(str(init_dir / f"init_{family}"), config=config)
    if sp:  # the sequence-parallel parameters' gradients are partial sums until all-reduced
        from paddle.distributed.fleet.utils.sequence_parallel_utils import (
            register_sequence_parallel_allreduce_hooks,
        )

        register_sequence_parallel_allreduce_hooks(model, 1, False)
    enabled = precision in AMP
    dtype, level = AMP[precision] if enabled else ("float16", "O1")  # (unused in fp32)
    o2 = enabled and level == "O2"
    opt: Any = paddle.optimizer.AdamW(  # fleet's and the sharding wrappers later
        learning_rate=LR, parameters=model.parameters(), multi_precision=o2
    )
    scaler = (
        paddle.amp.GradScaler(init_loss_scaling=LOSS_SCALE)
        if enabled and dtype == "float16"
        else None
    )
    if o2:  # as runner.train builds it: bf16/fp16 weights, fp32 master weights
        model, opt = paddle.amp.decorate(
            models=model, optimizers=opt, level="O2", dtype=dtype, master_weight=True
        )

    def amp() -> contextlib.AbstractContextManager[None]:
        if not enabled:
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(enable=True, level=level, dtype=dtype)

    # the data-parallel width: which part of the global batch this rank trains on
    if hcg is None:
        dp_width, dp_rank = world, rank
    else:
        dp_width = hcg.get_data_parallel_world_size() * hcg.get_sharding_parallel_world_size()
        dp_rank = (
            hcg.get_data_parallel_rank() * hcg.get_sharding_parallel_world_size()
            + hcg.get_sharding_parallel_rank()
        )
    if layout in ("stage2", "stage3"):
        from paddle.distributed.sharding import group_sharded_parallel

        model, opt, scaler = group_sharded_parallel(
            model, opt, level="os_g" if layout == "stage2" else "p_g_os", scaler=scaler
        )
    elif hcg is not None:
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(opt)
        if scaler is not None:
            scaler = fleet.distributed_scaler(scaler)
    per = BATCH // dp_width
    losses: list[float] = []
    times: list[float] = []
    off: list[str] = []
    for x, y in _batches():
        xs = paddle.to_tensor(x[dp_rank * per : (dp_rank + 1) * per])
        ys = paddle.to_tensor(y[dp_rank * per : (dp_rank + 1) * per])
        t0 = time.perf_counter()
        if pp > 1:
            with amp():
                loss = model.train_batch([xs, ys], optimizer=opt, scaler=scaler)
        else:
            with amp():
                loss = _loss(model(xs, labels=ys))
            (loss if scaler is None else scaler.scale(loss)).backward()
            first = not losses
            if first:
                off = off_device(model, opt, device_type)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            if first:  # the step's own ops (the loss scaler's unscale) keep them there too
                off += [o for o in off_device(model, opt, device_type) if o not in off]
            opt.clear_grad()
        loss = loss.detach().clone().astype("float32")
        if dp_width > 1:  # the global batch's loss: the mean over the data-parallel ranks
            if hcg is None:
                dist.all_reduce(loss)
            else:  # over the data-parallel and sharding groups only (not the tp/pp ranks)
                for group in (hcg.get_data_parallel_group(), hcg.get_sharding_parallel_group()):
                    if group.nranks > 1:
                        dist.all_reduce(loss, group=group)
            loss = loss / dp_width
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.numpy().reshape(-1)[0]))
    off += [o for o in off_device(model, opt, device_type) if o not in off]
    return {"losses": losses, "step_s": times, "off_device": off}


def run(
    layouts: list[str],
    out_dir: Path,
    precisions: tuple[str, ...] = ("fp32",),
    families: tuple[str, ...] = FAMILIES,
) -> None:
    import paddle
    import paddle.distributed as dist

    from runner.device import DEVICE_TYPE, activate_if_on_device

    if not activate_if_on_device():
        raise SystemExit(
            f"not on the rehearsal device ({paddle.get_device()}): launch with runner.device.env()"
        )

    groups = {GROUPS[layout][0] for layout in layouts}
    if len(groups) != 1:
        raise SystemExit(f"layouts {layouts} need different process groups; launch them separately")
    hcg = _hybrid(groups.pop())
    result: dict = {
        "place": str(paddle.get_device()),
        "world": dist.get_world_size(),
    }
    for layout in layouts:
        for family in families:
            for precision in precisions:
                paddle.seed(2024)
                key = f"{layout}/{family}" + ("" if precision == "fp32" else f"/{precision}")
                result[key] = run_layout(layout, family, out_dir, hcg, DEVICE_TYPE, precision)
    # every rank's off-device findings count: gather them on rank 0
    findings: list = []
    dist.all_gather_object(
        findings, {k: v["off_device"] for k, v in result.items() if isinstance(v, dict)}
    )
    if dist.get_rank() == 0:
        for rank, per_rank in enumerate(findings):
            for key, bad in per_rank.items():
                result[key].setdefault("off_device_by_rank", {})[str(rank)] = bad
        name = "+".join(layouts)
        if precisions != ("fp32",):
            name += "." + "+".join(precisions)
        tmp = out_dir / f".{name}.json.tmp"
        tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
        os.replace(tmp, out_dir / f"{name}.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runner.device.selftest", description=__doc__)
    parser.add_argument("mode", choices=["reference", "run"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layouts", default="")
    parser.add_argument("--precisions", default="fp32")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args(argv)
    families = tuple(x for x in args.families.split(",") if x)
    precisions = tuple(x for x in args.precisions.split(",") if x)
    for flag, got, allowed in (
        ("--families", families, FAMILIES),
        ("--precisions", precisions, PRECISIONS),
    ):
        unknown = [x for x in got if x not in allowed]
        if unknown:
            parser.error(f"{flag}: {unknown[0]!r} is not one of {', '.join(allowed)}")
    if args.mode == "reference":
        reference(args.out, families)
    else:
        run([x for x in args.layouts.split(",") if x], args.out, precisions, families)
        # Every rank has passed the all-gather and rank 0 has written the results: end without
        # the interpreter's teardown, where a device process now and then aborts (SIGABRT after
        # every rank had finished, about 1 launch in 20), which made a finished launch look
        # failed (docs/device.md, "Limits")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    from gptplan import paddlenlp_light

    paddlenlp_light.enable()  # PaddleNLP's models without the rest of it
    main()

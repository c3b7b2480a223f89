"""The corpus: statistics measured on the job's corpus (documents, characters, tokens per
character with the planned tokenizer) and the data-preparation estimate (corpus_stats,
dataprep).

May import: gptplan, planner.spec and planner.market (a profile's CPU for the estimate).
"""

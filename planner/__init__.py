"""planner: choose the cheapest way to pretrain a GPT with PaddlePaddle, write it as a plan."""

__version__ = "0.1.0"

"""Examples apart from the engine: a small GPT in plain torch (`models`) and `python -m
zero.examples.demo`."""

"""Examples apart from the engine: a small GPT in plain torch (`models`) and the demo
(`python -m zero.examples.demo`)."""

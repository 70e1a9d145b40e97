"""`@output_formatter`: marks the model.py function that rewrites each response the built-in handler
gives (`fn(response_data: dict) -> dict`; a streamed answer: each line's object)."""


def output_formatter(fn):
    fn.is_output_formatter = True
    return fn

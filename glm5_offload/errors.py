"""The one error type the command line turns into a single line and exit code 2."""


class Glm5Error(Exception):
    """A user-facing error: its message names the file, key or value at fault, on one line."""


class ModelError(Glm5Error):
    """The model failed on good input (its logits not finite): a broken checkpoint or kernel, not the user's input."""


def out_of_memory_said(e: BaseException) -> str:
    """torch's out-of-memory message cut to its first three sentences: what it tried to allocate, on which GPU, what
    was free (the rest is advice about its allocator)."""
    return ". ".join(str(e).split(". ")[:3]).rstrip(".")

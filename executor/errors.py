"""Errors the executor raises for bad input (a plan that does not match the model or the launch), and how a
message is quoted in one line."""


class ExecutorError(ValueError):
    """A plan cannot be applied here; the message names the problem and the fix."""


def first_line(text: str) -> str:
    """The first line of `text` with leading and trailing blanks stripped ("" for blank text): how an exception's
    message is quoted in one line."""
    return text.strip().splitlines()[0] if text.strip() else ""


def shorten(text: str, width: int) -> str:
    """`text`'s first line, cut at a word boundary with "..." when longer than `width` (a note quoting an
    exception's message must not stop mid-word, as if the rest of the note were the message)."""
    line = first_line(text)
    if len(line) <= width:
        return line
    return line[:width].rsplit(" ", 1)[0].rstrip(" ,;:(") + " ..."

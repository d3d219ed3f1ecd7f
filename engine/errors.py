"""How an exception reads in one line (events, warnings, the console's node states)."""


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first line of the exception's text (at most `limit` characters); its type's name when it has no text."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__

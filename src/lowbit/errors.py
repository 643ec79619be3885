"""The one exception type for bad input that the CLI turns into a single sentence on stderr."""


class LowbitError(ValueError):
    """Bad input or an unsupported request, with a message meant for the user.

    Subclasses ValueError so library callers can catch it with the standard type.
    """

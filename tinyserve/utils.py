"""Small helpers both processes use; plain Python, importing nothing."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a items."""
    return -(-a // b)

"""The generations of a sequence, as the round recursions read them (tests/test_rounds.py,
tests/objectives/test_edr.py)."""


def generations(mask: list[bool]) -> list[tuple[int, int]]:
    """(first anchor, last position) of every maximal supervised run; position 0 is never predicted."""
    out, t = [], 1
    while t < len(mask):
        if mask[t]:
            end = t
            while end + 1 < len(mask) and mask[end + 1]:
                end += 1
            out.append((t - 1, end))
            t = end + 1
        else:
            t += 1
    return out

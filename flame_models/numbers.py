"""Reading a number the user gave (a CLI value, a keyword argument, a "b1=1.3" field): `as_float`."""


def as_float(value):
    """`value` as a float -- a number or a numeric string --, NaN for anything else (a bool, None, other text), so a
    caller's range check (`lo <= x <= hi` is False for NaN) refuses it with its own message."""
    if isinstance(value, bool):
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return float("nan")

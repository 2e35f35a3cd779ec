"""The session protocol's settings that the config names, torch-free (the application's schema imports them)."""

DELTA_MODES = ("off", "on", "auto")
"""``off``: every round dense, nothing kept. ``on``: every round that can be a delta round is one (each tensor
still goes dense where its changes would take more bytes). ``auto``: as ``on`` while the changes take less than
:data:`AUTO_SHARE` of the dense bytes and delta rounds are faster than dense ones, measured; dense otherwise."""
DEFAULT_DELTA = "off"


def agreed_delta(mode: str) -> bool | str:
    """``refit.delta`` as a sharded refit's plan is agreed with (``agree``'s ``delta``): off False, on True, auto
    ``"auto"``."""
    return {"off": False, "on": True}.get(mode, mode)


DEFAULT_ROUNDS = 1
"""``refit.rounds`` of a producer that sets none (a consumer that sets none adopts the producer's)."""
AUTO_SHARE = 0.5
"""``auto``'s threshold: the share of the dense round's bytes under which a round goes as a delta."""
AUTO_RETRY_ROUNDS = 32
"""After a delta round was slower than a dense one, ``auto`` sends dense rounds until the changes are half as many as
then, or for this many rounds, and then tries a delta round again (one slow round in 32 costs ~3%)."""

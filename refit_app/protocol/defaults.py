"""The session protocol's settings that the config names, torch-free (the application's schema imports them)."""

DELTA_MODES = ("off", "on", "auto")
"""``off``: every round dense, nothing kept. ``on``: every round that can be a delta round is one (each tensor
still goes dense where its changes would take more bytes). ``auto``: as ``on`` while the changes take less than
:data:`AUTO_SHARE` of the dense bytes, dense otherwise."""
DEFAULT_DELTA = "off"
AUTO_SHARE = 0.5
"""``auto``'s threshold: the share of the dense round's bytes under which a round goes as a delta."""

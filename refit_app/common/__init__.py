"""The bottom layer: errors a user can act on, byte sizes as users type and read them, crash-safe file writes and
the collector that reports every invalid setting at once. Torch-free; imports nothing else of refit_app."""

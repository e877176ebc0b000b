"""The rank process: one model replica on one device (see ``runner.py`` and the parts it composes)."""

"""The rank process: one model replica on one device (see ``runner.py``)."""

"""A run on disk: its output folder (`folder.py`: the lock, fresh or resumed), checkpoints written atomically
(`checkpoint.py`) and resuming from them (`resume.py`)."""

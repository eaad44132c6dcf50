"""Model families the trainer knows (see ../family.py); each module registers nothing itself: family.py's registry
names them, and imports one only when it is asked for."""

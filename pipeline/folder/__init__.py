"""The artifact folder engines/<model>-<precision>/: its record and file names (manifest), safe writes (artifacts)
and the one way to open it (reader).  stages/sequence.py is its one writer."""

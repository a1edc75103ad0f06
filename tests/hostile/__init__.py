"""The hostile-input corpus (corpus.py) and its tripwire module; replayed by tests/test_hostile_corpus.py."""

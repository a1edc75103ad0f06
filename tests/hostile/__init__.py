"""The hostile-input corpus (corpus.py) and its tripwire module; replayed by tests/e2e/test_hostile_corpus.py."""

"""reducing_saver.client: placeholder until the client lands."""

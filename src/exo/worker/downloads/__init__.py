"""Downloading a model's files: from a peer node or the Hugging Face hub,
resumable and verified."""

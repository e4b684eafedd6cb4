"""Speculative decoding: proposers guess a request's next tokens; one forward pass verifies them."""

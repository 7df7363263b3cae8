"""Speculative decoding: proposers guess a request's next tokens on the host, one verify step scores them all with
the target model, and `rejection` keeps the target's distribution exactly (docs/spec_decode.md)."""

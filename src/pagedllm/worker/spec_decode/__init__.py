"""Speculative decoding: proposers guess the next tokens, the target model verifies them all
in one forward, and the rejection sampler keeps the target's output distribution."""

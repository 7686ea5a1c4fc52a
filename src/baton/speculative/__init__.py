"""Speculative decoding with the MTP draft: proposal chains and exact verification."""

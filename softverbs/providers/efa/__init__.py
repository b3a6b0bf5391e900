"""EFA direct-verbs mirror (pyverbs.providers.efa)."""

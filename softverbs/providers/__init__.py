"""Provider-specific extensions, laid out as pyverbs.providers."""

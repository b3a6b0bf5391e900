"""Operations: the Prometheus metrics, the self-test's far side, and the generated parts of ``docs/``."""

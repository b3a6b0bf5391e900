"""The models: parts of the daemon written again in plain Python and numpy, which the daemon never runs.

Each is the rule set a compiled part follows, kept so the tests can hold that part to it (a change to the
rules lands in both, or the differential test fails) and, for the engine, as the baseline of
``transportd bench proxy``:

- :mod:`transportd_models.engine` -- the proxy's loop (:class:`~transportd_models.engine.ModelProxy`) and
  the rail worker's serve loop (:func:`~transportd_models.engine.model_serve`): the model of the engine
  (``transportd/core/engine.c``) behind :class:`transportd.dataplane.proxy.Proxy`;
- :mod:`transportd_models.translate` -- records to validated plan rows (the model of
  ``transportd/core/validate.h``), through the daemon's own tables (:mod:`transportd.dataplane.tables`);
- :mod:`transportd_models.batching` -- batches per connection and decoupled signaling (the engine's
  batching);
- :mod:`transportd_models.arrivals` -- efa's counting scheme, both ends (``efa/csrc/efa_post.c`` numbers
  the groups, ``efa/csrc/efa_arrivals.c`` counts the arrivals);
- :mod:`transportd_models.ib_lowering` and :mod:`transportd_models.efa_lowering` -- plan rows to verbs calls,
  the lowering each backend's C poster (``ib/csrc/ib_post.c``, ``efa/csrc/efa_post.c``) is compared with.

This package stands above the daemon and the backends (it imports both) and below the commands; nothing
the daemon, a backend or the client library runs imports it (``tests/test_import_layers.py``).
"""

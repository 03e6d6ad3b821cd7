"""The local HTTP API of a user node (:mod:`ps_p2p.api.openai_compat`): OpenAI-style
``/v1/completions`` and ``/v1/models`` served by hypercorn on trio, for applications on the
user's own machine. Node layer: it only calls :class:`ps_p2p.roles.user.UserClient`."""

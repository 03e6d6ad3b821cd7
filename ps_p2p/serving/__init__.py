"""Model serving cores (pure): the model node's dispatch (:mod:`ps_p2p.serving.dispatch`);
later issues add HR-tree forwarding here."""

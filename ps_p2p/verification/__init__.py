"""Verification of model serving (PlanetServe sec. 3.4, Algorithm 3), pure cores.

* :mod:`ps_p2p.verification.scoring`: a response's credibility C, its normalised perplexity
  under the verifier's reference model, in one forward pass (and the paper's per-token loop as
  the reference implementation);
* :mod:`ps_p2p.verification.reputation`: the reputation rule R(T) = alpha R(T-1) + beta C(T)
  with the sliding-window punishment, per organization or node, and the untrusted threshold;
* :mod:`ps_p2p.verification.epochs`: the leader of an epoch, the seed commit-reveal that keeps
  the challenge plan secret from model nodes and out of the leader's hands, the plan itself,
  the >1/3 miss tally and the score tolerance.

Nothing here does I/O, reads a clock or draws randomness; the scoring helpers await the engine.
"""

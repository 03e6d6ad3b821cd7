"""Pure cryptographic cores of the overlay (no I/O, no clock, randomness injected):

* :mod:`ps_p2p.crypto.sida` -- S-IDA (Krawczyk 1993): AES-256-GCM, a k-of-n erasure code and
  Shamir key shares; any k cloves decode;
* :mod:`ps_p2p.crypto.onion` -- the fixed-size onion setup packet and the layered cells of one
  size on every link (PlanetServe sec. 3.2, with DESIGN.md's fixes).
"""

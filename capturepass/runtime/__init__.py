"""The runtime: graph owners, lanes, and the outer program that runs compiled regions.

Design note. Everything the IR names by integer handle becomes a real object
here, per graph owner: lanes become streams (or host no-ops), leases become
events, retention becomes references held for a capture's life. An owner never
shares any of them with another owner.
"""

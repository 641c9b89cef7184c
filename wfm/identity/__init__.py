"""Identity: who is calling and what proves it. Clients and their credentials, mutual
TLS with X.509-SVIDs, rc.2 request signatures and onboarding keys, the server's own CA,
and constant-time comparison of presented secrets.
"""

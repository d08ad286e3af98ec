"""pytest hooks: tests that need root or the network say so with a marker and skip clearly without them."""

"""pdserve connectors package."""

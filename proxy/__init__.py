"""pdserve proxy package."""

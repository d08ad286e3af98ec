"""pdserve kvstore package."""

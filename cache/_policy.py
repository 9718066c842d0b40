"""The cache policy and the credential rule: they belong to the kernel, which decides what
is cached; re-exported here for the stores and their users."""

from dispatcher._credentials import carries_credentials
from dispatcher._policy import DEFAULT_TTL, CachePolicy, resources_overlap

__all__ = ["DEFAULT_TTL", "CachePolicy", "carries_credentials", "resources_overlap"]

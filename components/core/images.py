"""Container images the components run in (built from images/; override with env at compile time)."""

import os

REGISTRY = os.environ.get("AGENTRL_IMAGE_REGISTRY", "ghcr.io/agentrl")
TAG = os.environ.get("AGENTRL_IMAGE_TAG", "0.1.0")
TRAINER = os.environ.get("AGENTRL_TRAINER_IMAGE", f"{REGISTRY}/trainer:{TAG}")
ROLLOUT = os.environ.get("AGENTRL_ROLLOUT_IMAGE", f"{REGISTRY}/rollout:{TAG}")
SANDBOX = os.environ.get("AGENTRL_SANDBOX_IMAGE", f"{REGISTRY}/sandbox:{TAG}")

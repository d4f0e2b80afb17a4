"""torch.distributed calls that differ between the torch versions the DDP front end supports."""
import torch.distributed as dist

__all__ = ["all_gather_single"]

#: Every rank's tensor into one output tensor: torch 2.13 names it all_gather_single and deprecates
#: all_gather_into_tensor; older torch has only the latter.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

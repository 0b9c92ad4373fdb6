"""DeepSpeed ZeRO actor backend (``--actor.backend deepspeed``; see README.md in this folder). DeepSpeed is
imported by the submodules only, inside the rank processes."""

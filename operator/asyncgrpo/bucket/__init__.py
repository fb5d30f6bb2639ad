"""`asyncgrpo bucket setup|cleanup`: what runs in a run's bucket Job (its own pod, never the
operator's).

* `policy`: what the operator and the Job agree on, with no S3 in it: `BucketError` and its
  reasons, `Owner`, `run_folder`, the endpoint allowlist and metadata addresses
  (`check_endpoint`, `metadata_excepts`). The operator (`asyncgrpo.controller`) imports only
  this module of the package.
* `folder`: the Job's S3 work (the bucket ensured, the run folder claimed with its ownership
  marker, emptied on deletion), every request through `asyncgrpo.storage`.
* `command`: the `asyncgrpo bucket` subcommand, the Job's container command.

The Job itself (manifest, outcome) is built by `asyncgrpo.controller.bucketjob`.
"""

"""pagedkv: the public client, CLI and generated protobuf code (`pagedkv.v1`, made by `make proto`)."""

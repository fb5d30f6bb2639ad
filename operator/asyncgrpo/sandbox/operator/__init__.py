"""The operator side: `sizing`, the pool-sizing rule `controller.sandbox_scaling` and the
local backend's pool apply. Pure: imports nothing of the sandbox package."""

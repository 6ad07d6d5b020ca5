"""Compiler flags shared by every offloadd target."""

# Warnings are errors for our own code; generated protobuf code uses
# GENERATED_COPTS because protoc's output is not ours to fix.
COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
]

GENERATED_COPTS = ["-w"]

#!/bin/sh
echo "coverage reports are not generated offline" >&2
exit 0

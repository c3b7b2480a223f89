#pragma once
// the device type Paddle registers (the place is "gptplan_cpu:<rank>")
#define GPTPLAN_DEVICE_TYPE "gptplan_cpu"

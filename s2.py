import devicekit as dk, bsfns, sys
if __name__ == "__main__":
    try:
        dk.find_batch_size(bsfns.spawner, isolate=True, trial_timeout=3)
    except TimeoutError as e:
        print("timeout:", e)

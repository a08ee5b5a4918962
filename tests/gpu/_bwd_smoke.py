import sys, time, threading, os
sys.path.insert(0, os.getcwd())
def watchdog(sec):
    time.sleep(sec); print("WATCHDOG: hang, exiting", flush=True); os._exit(3)
threading.Thread(target=watchdog, args=(float(sys.argv[1]),), daemon=True).start()
import torch
torch.backends.cuda.matmul.allow_tf32 = False
from tests.gpu import test_bwd_sm90 as T
cases = sys.argv[2:]
for c in cases:
    t = time.time()
    print("CASE", c, flush=True)
    try:
        eval(c, {"T": T, "torch": torch})
        torch.cuda.synchronize()
        print("  ok", round(time.time() - t, 1), flush=True)
    except AssertionError as e:
        print("  FAIL", str(e)[:300], flush=True)
    except Exception as e:
        import traceback; traceback.print_exc(); print("  ERROR", type(e).__name__, str(e)[:300], flush=True)
print("DONE", flush=True)
os._exit(0)

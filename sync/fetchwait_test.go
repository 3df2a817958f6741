package sync

import "time"

// The package's tests run with a FetchWait default of 5s, not 25ms (defaultFetchWait):
// on a loaded machine (CI, -race, other tests beside) an exact sync can take longer than
// 25ms, and a test that is not about the wait then saw a refusal with a retry of one
// sync interval that it does not test. Tests about the wait set FetchWait themselves.
func init() { defaultFetchWait = 5 * time.Second }

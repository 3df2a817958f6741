package localbucket_test

import (
	"fmt"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

func ExampleLimit_Take() {
	// 10 requests per second, burst 10: a token every 100ms.
	l, err := localbucket.NewLimit(localbucket.TokenBucket, 10, time.Second, 0)
	if err != nil {
		panic(err)
	}
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()
	var s localbucket.State // a fresh key: the bucket is full

	s, r := l.Take(s, now, 10)
	fmt.Println(r.Allowed, r.Remaining, time.Duration(r.Reset))

	s, r = l.Take(s, now+int64(50*time.Millisecond), 1)
	fmt.Println(r.Allowed, r.Remaining, time.Duration(r.RetryAfter))

	_, r = l.Take(s, now+int64(r.RetryAfter)+int64(50*time.Millisecond), 1)
	fmt.Println(r.Allowed, r.Remaining, time.Duration(r.Reset))
	// Output:
	// true 0 1s
	// false 0 50ms
	// true 0 1s
}
